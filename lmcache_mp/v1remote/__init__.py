"""The v1 remote protocol (LMCache's standalone-server TCP format): wire format, a server, a client."""
