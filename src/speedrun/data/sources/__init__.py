"""Where the images come from: the built-in datasets, arrays and image folders, and how they
are downloaded, read, verified, decoded and cached."""
