"""Where checkpoint bytes live. One backend per module; today: the local file system."""
