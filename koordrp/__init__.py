"""koordrp: a runtime proxy between kubelet and the container runtime, with Koordinator's runtime hooks."""
