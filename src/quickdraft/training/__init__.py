"""Training what drafts: the feature drafter (:mod:`quickdraft.training.feature_drafter`)."""
