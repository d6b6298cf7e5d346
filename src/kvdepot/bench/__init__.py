"""The ``kvdepot bench`` workloads and the ``kvdepot demo``."""
