"""SpecLens desktop app (Qt). Adapts engine events to widgets; holds no decoding logic."""
