"""Proposers (drafters): the protocol the engine drafts through (protocol.py: `Proposer`, `DraftContext`,
`DrafterBase`), the model-free n-gram drafter (ngram.py), the small-model drafter (small_model.py), and draft-tree
geometry (draft_tree.py: masks, depths, chain and top-k trees). The EAGLE proposer is drafter/eagle_proposer.py's.
None of them imports the engine (rollout/).
"""
