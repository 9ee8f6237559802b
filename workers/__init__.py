"""k3serve.workers"""
