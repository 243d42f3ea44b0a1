"""The pipeline's roles by what they do (names of ``RLVRConfig`` sections)."""

from __future__ import annotations

# Roles that run on devices (GPUs, or CPU slots on CPU machines) and need a device_mapping.
DEVICE_ROLES = ("actor_train", "actor_infer", "reference", "critic")
# Roles that train on the rollout batch every step.
TRAIN_ROLES = ("actor_train", "critic")
