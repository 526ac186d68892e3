"""Facts about the engines qdeploy targets, read by every later stage (lint, quantize, artifacts, engines):
one module per engine, each fact with its source."""
