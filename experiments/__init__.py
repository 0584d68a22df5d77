"""The lab: experiments outside the product (see README.md); not packaged."""
