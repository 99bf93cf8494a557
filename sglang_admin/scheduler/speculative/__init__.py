"""Speculative decoding at a rank: the policy (NGRAM drafts, adaptive draft length), STANDALONE's
draft model and drafter, and the verification of a step's drafts."""
