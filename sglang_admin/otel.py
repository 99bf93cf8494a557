"""Optional OpenTelemetry SDK set-up for `--otlp-traces-endpoint`."""

from __future__ import annotations


def configure_otlp(endpoint: str) -> None:
    """Install a tracer provider exporting spans over OTLP/gRPC to `endpoint`."""
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise RuntimeError(
            "--otlp-traces-endpoint needs opentelemetry-sdk and "
            "opentelemetry-exporter-otlp-proto-grpc (pip install 'sglang-admin[otlp]'); "
            f"missing: {exc.name}"
        ) from None
    provider = TracerProvider(resource=Resource.create({"service.name": "sglang-admin"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
