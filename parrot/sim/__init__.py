"""parrot.sim"""
