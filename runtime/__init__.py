"""The worker: model loading, paged KV cache, scheduler, graph runner, sampler, server."""
