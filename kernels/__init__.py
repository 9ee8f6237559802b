"""k3serve.kernels"""
