"""The service's configuration: settings and their checks, TLS files, the OTLP export."""
