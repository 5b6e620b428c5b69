"""Deployment: `pdserve up` on this machine (`launcher`), the plan file a planner hands to a
deployer (`plan`), and Kubernetes manifests rendered from a plan (`k8s`, with the manifests
themselves shipped as package data in `serve.deploy.manifests`, the repository's `k8s/`)."""
