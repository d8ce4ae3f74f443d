"""parrot.backends"""
