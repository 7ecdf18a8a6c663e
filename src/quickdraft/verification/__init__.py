"""Verification: the distributions both models are sampled under and the acceptance rules.

The bottom layer: pure, batched functions of target and draft probabilities. Nothing here knows
about models, caches or the decoding loop.

``sampling``
    temperature / top-k / top-p: the distribution both models are sampled and verified under
``rules``
    acceptance rules behind one interface (``Lossless``, ``Greedy``, ``Fuzzy``, ``Typical``,
    ``ExponentialRace``)
``divergences``
    divergences between target and draft distributions (FSD)
``race``
    shared exponential-race noise, regenerated from (seed, row, position)
``verify``
    ``verify_chain``: pure, batched chain verification
``multidraft``, ``multidraft_proposals``, ``multidraft_verifiers``
    multi-draft proposals and verifiers at the step level
"""
