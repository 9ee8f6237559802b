"""k3serve.kvstore"""
