"""k3serve.router"""
