"""The Kubernetes side: the OmniPipeline CRD (generated from the spec model), rendering, the operator."""
