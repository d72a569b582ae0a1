"""The training methods, one module per family (supervised, preference), named by registry.py."""
