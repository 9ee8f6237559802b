"""k3serve: serving platform for Kimi K3-class hybrid (KDA + MLA) models."""

__version__ = "0.1.0"
