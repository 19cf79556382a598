"""Work done with the target before training: regenerated data, cached hidden states.

regenerate    training data rewritten with the target's own replies
hidden_cache  the offline hidden-state cache: its format, writer and reader
"""
