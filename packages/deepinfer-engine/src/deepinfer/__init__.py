"""deepinfer: the user facade."""
