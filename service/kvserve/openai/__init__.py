"""The OpenAI HTTP kit shared by the engine server and the gateway.

Request schemas (``protocol``), the checks both front ends apply before a request reaches
an engine (``checks``), response and chunk bodies (``format``), server-sent events
(``sse``), errors in the OpenAI shape (``errors``), body parsing (``body``), the
request-id middleware (``middleware``) and disconnect handling (``disconnect``).
Nothing here knows about the engine or the replicas.
"""
