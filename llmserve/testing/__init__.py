"""Test harnesses that run the real engine end to end (the soak); imported by tests and
experiments, never by the library itself."""
