"""Test helpers that use real system parts: ``netns`` builds a bandwidth-limited network on one machine."""
