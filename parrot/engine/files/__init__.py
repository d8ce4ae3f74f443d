"""Model files without torch: the model config, the GGUF reader, where the default model lives, the tokenizer.
"""
