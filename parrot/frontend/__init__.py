"""The Python frontend: SemanticVariable, semantic / native functions and sessions (re-exported by ``parrot``)."""
