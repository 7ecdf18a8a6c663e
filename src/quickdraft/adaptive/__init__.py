"""Adaptive drafting, offline: training SpecDec++'s acceptance head and replaying policies.

The policies themselves run in :mod:`quickdraft.decoding.policies` and
:mod:`quickdraft.decoding.head`; this layer sits above the pipeline because training drives it.

``headtrain``
    collecting features and training the acceptance head (``quickdraft train-head``)
``trainprompts``
    the training prompts
``replay``
    exact replay of greedy speculative decoding: every draft-length policy and the clairvoyant
    bound from one output
"""
