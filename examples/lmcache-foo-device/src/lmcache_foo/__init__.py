"""Sample LMCache device backend for the fictional Foo accelerator (``torch.foo``)."""
