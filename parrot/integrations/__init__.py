"""Adapters that let other LLM frameworks run on Parrot (``parrot.integrations.langchain``). Each imports its
framework lazily, so ``import parrot`` never needs them; install the matching extra (``pip install
parrot-serve[langchain]``)."""
