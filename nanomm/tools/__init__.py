"""Tooling outside the request path: random-weight checkpoints (in the Hugging Face layout) for tests, lessons and
the offline demo. A reader following a request never needs these files.
"""
