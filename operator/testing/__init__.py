"""Test support for the operator: a Kubernetes API emulator for kopf (needs the test extras)."""
