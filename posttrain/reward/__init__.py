"""Rewards: rule scorers dispatched by data_source, custom functions, and the batch reward manager."""

from .registry import (default_compute_score, extract_answer_for, known_data_sources, load_custom_reward_function,
                       register_scorer)

__all__ = ["default_compute_score", "extract_answer_for", "known_data_sources", "load_custom_reward_function",
           "register_scorer"]
