"""Test helpers that use real system parts: ``netns`` builds a bandwidth-limited network on one machine;
``real_models`` holds tiny real transformers and timm models (the conformance suite's), and
``torchvision_compat`` makes torchvision importable where its compiled operators do not load."""
