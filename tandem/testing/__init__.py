"""Test helpers that use real system parts (the bandwidth-limited network is ``tandem.netns``):
``real_models`` holds tiny real transformers and timm models (the conformance suite's), ``reference``
eager PyTorch training to compare against, and ``torchvision_compat`` makes torchvision importable
where its compiled operators do not load."""
