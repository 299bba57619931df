"""Save and restore param trees with Orbax (bit-exact round trip)."""

from __future__ import annotations

import os

import jax
import numpy as np


def save_params(directory: str, params) -> None:
    """Saves a param pytree under ``directory`` (created; must not exist yet)."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    with ocp.PyTreeCheckpointer() as ckptr:
        ckptr.save(directory, jax.tree_util.tree_map(np.asarray, params))


def restore_params(directory: str):
    """Restores a param pytree saved by ``save_params`` as numpy arrays."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    if not os.path.isdir(directory):
        raise ValueError(f"{directory}: no Orbax checkpoint directory")
    with ocp.PyTreeCheckpointer() as ckptr:
        return ckptr.restore(directory)
