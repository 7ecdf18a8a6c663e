"""Decoding: the one batched loop and what it drives.

A step proposes a token tree (a chain is its width-one case), the target scores it in one forward,
a verifier walks it and the commit rolls both caches back to the walked path. Built on
:mod:`quickdraft.verification` and the runners of :mod:`quickdraft.backends`.

``engine``
    ``Decoder.step`` (propose, score, verify, commit) and ``generate``
``proposals``
    the step's verbs: ``Proposer``, ``Proposal``, ``Walk``; ``ChainProposer``
``drafters``, ``phrase``, ``retrieval``, ``contrastive``, ``amusd``
    sources of draft tokens
``tree``, ``tree_decoding``, ``tree_shapes``
    token trees as data, the tree drafter, proposal and walk, tree shapes
``policies``, ``head``
    draft-length policies and SpecDec++'s acceptance head
``metrics``
    exact per-sequence and aggregated metrics
"""
