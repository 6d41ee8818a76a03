"""What meets gRPC: the interceptors (metrics, tokens, the guard that admits each call
against `admission.limits` and times its waits on its client), the four kinds of method
handler, health, reflection, TLS credentials and the /metrics HTTP server."""
