"""The gateway: the OpenAI front door to a fleet of engine replicas."""
