#!/usr/bin/env bash
# Placeholder until the Kubernetes work lands: a real helm binary into .tools/helm.
exit 0
