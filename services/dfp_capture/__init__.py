"""Capture: an OpenAI-compatible pass-through in front of a serving engine that records opted-in traffic
as completion records (the drafter's future training data), redacted and kept for a bounded time."""
