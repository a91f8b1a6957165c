"""Adapters that plug the rollout worker into RL trainers (verl first)."""
