"""The DFlash training objective.

noise      which non-anchor block positions are masked (`NoiseSchedule`)
blocks     anchors, blocks, labels and context starts of a batch (`prepare_blocks`)
loss       the loss: position weights (decay, streak), the KL/CE mix, and the chunked
           production loss that never holds [B, N, Bs, V] logits
reference  the dense loss over whole logits, kept as the test oracle
"""
