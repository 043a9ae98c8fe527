"""What tests share: ports, waiting, and launchers for engine servers, replica processes
and gateways. Tests import these modules; no test imports a conftest or another test."""
