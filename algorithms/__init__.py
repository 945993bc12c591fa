"""Offline RL learners: BC, CQL and BCQ (see the algorithms issue)."""
