"""lightning-zero Fabric's adapter: ZeroFabricStrategy and its precision plugin."""
