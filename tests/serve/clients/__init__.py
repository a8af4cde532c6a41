"""Clients nobody here wrote (lm-evaluation-harness, langchain-openai) run against `omnijax serve` (issue 37 item 7)."""
