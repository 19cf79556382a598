"""The producer-consumer pipeline, independent of any model.

queues       stop-aware bounded queues, barrier, stage threads, counters, signals
stages       prefetcher, target and drafter loops wired around the two queues
distributed  torchrun ranks: process group, gradient averaging, the sharding rule
"""
