"""Tools a policy calls in multi-turn episodes: their schemas, how calls are parsed from its text, and how they run."""
