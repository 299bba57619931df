"""Speculative decoding: a proposer guesses R tokens, the target verifies them in one step.

verify.py (pure verifier), ngram.py (host n-gram lookup), draft.py / eagle.py (device draft
functions the runner may call), policy.py (host: config and the never-slower rule),
proposers.py (the engine-side objects behind one ``Proposer`` protocol, never imported by the
runner), and controller.py (the engine's speculation hooks around each step).
"""

from llmserve.speculative.ngram import NgramProposer
from llmserve.speculative.policy import SpeculationPolicy, SpeculativeConfig
from llmserve.speculative.verify import PAD_TOKEN, VerifyOutput, verify

__all__ = ["NgramProposer", "PAD_TOKEN", "SpeculationPolicy", "SpeculativeConfig",
           "VerifyOutput", "verify"]
