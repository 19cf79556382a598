"""Where ended spans go.

processor  the bounded batch processor: a queue that never blocks the ending thread,
           one export thread, exact delivery counts, a bounded shutdown
exporters  the exporters by name (the SDK's OTLP gRPC/HTTP exporters, the OTLP/JSON
           trace file, console), all behind the SDK's `SpanExporter` interface
"""
